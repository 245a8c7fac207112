"""Configuration: the article's checkpoint_config.yaml loads; bad values name field and range."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from hf_dynamic_ckpt.config import (
    GROUPS,
    WARNED,
    Compression,
    FallbackStrategy,
    LevelConfig,
    OptimizerLevelConfig,
    PolicyParams,
    SmartCkptArguments,
    SmartCkptConfig,
)
from hf_dynamic_ckpt.errors import ConfigError, UnknownConfigKeyError
from hf_dynamic_ckpt.store import CheckpointStore

ARTICLE_YAML = """\
# dynamic frequency
base_interval: 2000
stability_window: 100
risk_threshold: 0.68
# storage strategy
storage_levels:
  level_0:  # weights
    compression: none
    device: ssd
    retention_days: 30
  level_1:  # optimizer
    compression: zstd
    compression_level: 3
    device: nvme
    retention_days: 7
  level_2:  # metadata
    compression: gzip
    device: ssd
    retention_days: 90
# recovery strategy
recovery_timeout_ms: 5000  # degrade the load beyond this
fallback_strategy: "level_0_only"  # level_0_only, level_0_1, full
"""


@pytest.fixture
def notes_again() -> None:
    """Each configuration note is logged once per process: forget the ones given so far."""
    WARNED.clear()


def test_article_yaml_loads(tmp_path: Path, caplog: pytest.LogCaptureFixture, notes_again: None) -> None:
    path = tmp_path / "checkpoint_config.yaml"
    path.write_text(ARTICLE_YAML)
    with caplog.at_level("INFO", logger="hf_dynamic_ckpt.config"):
        cfg = SmartCkptConfig.from_yaml(path)
    # The dead keys the article has load, and say once that they have no effect.
    assert caplog.text.count("storage_levels.level_0.device='ssd' is not applied: every tier is stored under root") == 1
    assert "storage_levels.level_2.compression='gzip' is not applied" in caplog.text
    assert (cfg.base_interval, cfg.policy.stability_window, cfg.policy.risk_threshold) == (2000, 100, 0.68)
    assert cfg.storage_levels.level_1.compression is Compression.ZSTD
    assert cfg.storage_levels.level_1.compression_level == 3
    assert cfg.storage_levels.level_0.retention_days == 30
    assert cfg.runtime.fallback_strategy is FallbackStrategy.LEVEL_0_ONLY
    assert cfg.runtime.recovery_timeout_ms == 5000
    assert SmartCkptConfig.from_dict(cfg.to_dict()) == cfg  # YAML maps 1:1 onto the dataclasses


def test_policy_knobs_load_from_yaml(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("policy:\n  risk_gain: 2.5\n  stability_cv: 0.05\n  capture_cooldown: 40\n  memory_lookahead: 20\n"
                    "  grad_surge_ratio: 8\n  overhead_budget: 0.01\n  skip_bad_update: true\n")
    p = SmartCkptConfig.from_yaml(path).policy
    assert (p.risk_gain, p.stability_cv, p.capture_cooldown, p.memory_lookahead) == (2.5, 0.05, 40, 20)
    assert p.grad_surge_ratio == 8 and p.overhead_budget == 0.01 and p.skip_bad_update is True
    assert SmartCkptArguments(smart_ckpt_config=str(path), smart_ckpt_root="/r").to_config().root == "/r"


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("base_interval", 0, "base_interval=0 is invalid: expected an integer >= 1 or null"),
        ("base_interval", True, "base_interval=True is invalid: expected an integer >= 1"),
        ("min_interval", 0, "min_interval=0 is invalid: expected an integer >= 1."),
        ("stability_window", 2, "stability_window=2 is invalid: expected an integer >= 4."),
        ("risk_threshold", 1.5, "risk_threshold=1.5 is invalid: expected 0 < value <= 1."),
        ("risk_threshold", "high", "risk_threshold='high' is invalid: expected 0 < value <= 1."),
        ("risk_release", 0.9, "risk_release=0.9 is invalid: expected 0 <= value < risk_threshold (0.68)."),
        ("risk_smoothing", 0, "risk_smoothing=0 is invalid: expected an integer >= 1."),
        ("loss_spike_z", -1, "loss_spike_z=-1 is invalid: expected a positive number."),
        ("grad_surge_ratio", 1.0, "grad_surge_ratio=1.0 is invalid: expected a number > 1."),
        ("memory_threshold", 0.0, "memory_threshold=0.0 is invalid: expected 0 < value <= 1."),
        ("memory_sample_every", 0, "memory_sample_every=0 is invalid: expected an integer >= 1."),
        ("overhead_budget", 2.0, "overhead_budget=2.0 is invalid: expected 0 < value <= 1."),
        ("risk_gain", 0, "risk_gain=0 is invalid: expected 0 < value <= 100."),
        ("stability_cv", float("nan"), "stability_cv=nan is invalid: expected a positive number"),
        ("capture_cooldown", 0, "capture_cooldown=0 is invalid: expected an integer >= 1 or null"),
        ("lr_surge_ratio", 1, "lr_surge_ratio=1 is invalid: expected a number > 1."),
        ("memory_lookahead", 2.5, "memory_lookahead=2.5 is invalid: expected an integer >= 1."),
        ("mtbf_hours", 0, "mtbf_hours=0 is invalid: expected a positive number of hours."),
        ("keep_last", 0, "keep_last=0 is invalid: expected an integer >= 1, or null to keep every checkpoint."),
        ("fallback_strategy", "half",
         "fallback_strategy='half' is invalid: expected one of 'full', 'level_0_1', 'level_0_only'."),
    ],
)
def test_invalid_values_name_field_and_range(field: str, value: object, message: str) -> None:
    group = next((g for g, cls in GROUPS.items() if field in {f.name for f in dataclasses.fields(cls)}), None)
    with pytest.raises(ConfigError) as e:
        SmartCkptConfig(**{field: value}) if group is None else SmartCkptConfig(**{group: {field: value}})
    # A grouped setting is named as it is spelled: policy.stability_window=2 ...
    assert str(e.value).startswith(message if group is None else f"{group}.{message}")
    assert isinstance(e.value, ValueError)
    if group is not None:  # the group object itself says the same without the prefix
        with pytest.raises(ConfigError) as e:
            GROUPS[group](**{field: value})
        assert str(e.value).startswith(message)


def test_max_interval_below_min_names_both() -> None:
    with pytest.raises(ConfigError,
                       match=r"^policy\.max_interval=5 is invalid: expected an integer >= min_interval \(10\)\.$"):
        SmartCkptConfig(policy={"min_interval": 10, "max_interval": 5})


def test_yaml_errors_name_the_nested_field(tmp_path: Path) -> None:
    cases = [
        ("storage_levels:\n  level_1: {compression: zstd, compression_level: 25}\n",
         r"^storage_levels\.level_1\.compression_level=25 is invalid: expected 1 <= level <= 19\.$"),
        ("storage_levels:\n  level_0: {compression: zstd}\n",
         r"^storage_levels\.level_0\.compression='zstd' is invalid"),
        ("storage_levels:\n  level_3: {compression: none}\n", r"^unknown config key storage_levels\.'level_3'"),
        ("- 1\n- 2\n", "expected a mapping at the top level, got list"),
    ]
    for i, (text, message) in enumerate(cases):
        path = tmp_path / f"{i}.yaml"
        path.write_text(text)
        with pytest.raises(ConfigError, match=message):
            SmartCkptConfig.from_yaml(path)


def test_level_1_codec_must_be_zstd_or_none() -> None:
    with pytest.raises(ConfigError,
                       match=r"storage_levels.level_1.compression='gzip' is invalid: expected 'zstd' or 'none'"):
        SmartCkptConfig.from_dict({"storage_levels": {"level_1": {"compression": "gzip"}}})
    cfg = SmartCkptConfig.from_dict({"storage_levels": {"level_1": {"compression": "none"}}})
    assert cfg.storage_levels.level_1.compression is Compression.NONE


def test_level_2_gzip_loads_but_says_it_is_not_applied(caplog: pytest.LogCaptureFixture, notes_again: None,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    with caplog.at_level("WARNING", logger="hf_dynamic_ckpt.config"):
        SmartCkptConfig.from_dict({"storage_levels": {"level_2": {"compression": "gzip"}}})
        SmartCkptConfig.from_dict({"storage_levels": {"level_2": {"compression": "gzip"}}})
    assert caplog.text.count("storage_levels.level_2.compression='gzip' is not applied") == 1  # once per process
    caplog.clear()
    WARNED.clear()
    monkeypatch.setenv("RANK", "1")
    with caplog.at_level("WARNING", logger="hf_dynamic_ckpt.config"):
        SmartCkptConfig.from_dict({"storage_levels": {"level_2": {"compression": "gzip"}}})
    assert "not applied" not in caplog.text  # rank 0 says it for the job


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"policy": {"keep_log_spaced": "no"}}, "policy.keep_log_spaced='no' is invalid: expected true or false"),
        ({"root": 5}, "root=5 is invalid: expected a directory path (str) or null."),
        ({"root": "nosuch://bucket/run1"},
         "root='nosuch://bucket/run1' is invalid: 'nosuch' is not an fsspec protocol"),
        ({"root": "s3://"}, "root='s3://' is invalid: name a bucket or container"),
        ({"root": "s3://b/r", "remote": {"storage_options": {"secret": "x"}}},
         "remote.storage_options: secret looks like a credential"),
        ({"storage_levels": [1, 2]},
         "storage_levels=[1, 2] is invalid: expected a mapping with level_0 / level_1 / level_2."),
        ({"storage_levels": {"level_1": None}}, "storage_levels.level_1=None is invalid: expected a mapping such as"),
        ({"policy": {"mtbf_hours": float("inf")}},
         "policy.mtbf_hours=inf is invalid: expected a positive number of hours."),
        ({"runtime": {"preemption_signals": 15}},
         "runtime.preemption_signals=15 is invalid: expected a list of signal names"),
        ({"policy": [1]}, "policy=[1] is invalid: expected a mapping of PolicyParams settings such as {min_interval: "),
        ({"min_interval": 3}, "unknown config key 'min_interval' (it is policy.min_interval now: policy="
                              "{'min_interval': ...}, in YAML policy: {min_interval: ...}): allowed keys are "),
        ({"remote_retries": 3}, "unknown config key 'remote_retries' (it is remote.retries now: remote={'retries': "),
        ({"policy": {"retries": 3}}, "unknown config key policy.'retries' (it is remote.retries): allowed keys are "),
        ({"stability_window": 8, "policy": {"stability_window": 9}},
         "stability_window is given twice, at the top level and as policy.stability_window; keep one."),
        ({"save_total_limit": 3},
         "unknown config key 'save_total_limit' (Trainer's 'save_total_limit' is keep_last here)"),
        ({"save_steps": 500}, "unknown config key 'save_steps' (Trainer's 'save_steps' is base_interval here)"),
        ({"base_intervall": 4}, "unknown config key 'base_intervall' (did you mean 'base_interval'?)"),
        ({"storage_levels": {"level_1": {"compresion": "zstd"}}},
         "unknown config key storage_levels.level_1.'compresion' (did you mean 'compression'?)"),
        ({"on_save_error": "ignore"}, "on_save_error='ignore' is invalid: expected one of 'warn', 'raise'."),
        ({"runtime": {"preemption_exit_code": 300}},
         "runtime.preemption_exit_code=300 is invalid: expected an integer 0..255 or null"),
    ],
)
def test_strict_types_and_did_you_mean(data: dict, message: str) -> None:
    with pytest.raises(ConfigError) as e:
        SmartCkptConfig.from_dict(data)
    assert str(e.value).startswith(message), str(e.value)


def test_a_single_signal_name_is_a_list_of_one() -> None:
    config = SmartCkptConfig(runtime={"preemption_signals": "SIGTERM"})
    assert config.runtime.preemption_signals == ("SIGTERM",)


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: SmartCkptConfig(base_intervall=10),
         "SmartCkptConfig() got an unknown keyword 'base_intervall' (did you mean 'base_interval'?): allowed keys are "
         "base_interval, engine, keep_last, on_anomaly, on_save_error, policy, remote, root, runtime, storage_levels, "
         "task_id."),
        (lambda: SmartCkptConfig(async_save=False),
         "SmartCkptConfig() got an unknown keyword 'async_save' (removed: engine='sync' writes on the training thread "
         "(async_save=false); background writes are the default): allowed keys are "),
        (lambda: SmartCkptConfig(save_total_limit=2),
         "SmartCkptConfig() got an unknown keyword 'save_total_limit' (Trainer's 'save_total_limit' is keep_last "
         "here): allowed keys are "),
        (lambda: SmartCkptConfig().replace(keep_lats=2),
         "SmartCkptConfig() got an unknown keyword 'keep_lats' (did you mean 'keep_last'?): allowed keys are "),
        (lambda: OptimizerLevelConfig(compresion="zstd"),
         "OptimizerLevelConfig() got an unknown keyword 'compresion' (did you mean 'compression'?): allowed keys are "
         "compression, compression_level, retention_days."),
        (lambda: LevelConfig(compression="zstd"),  # the weights and state tiers are never compressed
         "LevelConfig() got an unknown keyword 'compression': allowed keys are retention_days."),
        (lambda: SmartCkptConfig(stability_window=50),
         "SmartCkptConfig() got an unknown keyword 'stability_window' (it is policy.stability_window now: "
         "policy={'stability_window': ...}, in YAML policy: {stability_window: ...}): allowed keys are "),
        (lambda: PolicyParams(rollback_patiense=2),
         "PolicyParams() got an unknown keyword 'rollback_patiense' (did you mean 'rollback_patience'?)"),
    ],
)
def test_an_unknown_keyword_names_the_closest_key(build: object, message: str) -> None:
    # The keyword path says what the dict and YAML paths say; the error is still a TypeError, as Python's own.
    with pytest.raises(UnknownConfigKeyError) as e:
        build()  # type: ignore[operator]
    assert isinstance(e.value, TypeError) and isinstance(e.value, ConfigError)
    assert str(e.value).startswith(message), str(e.value)
    with pytest.raises(UnknownConfigKeyError, match=r"^unknown config key 'base_intervall' \(did you mean"):
        SmartCkptConfig.from_dict({"base_intervall": 10})


def test_a_root_that_is_a_file_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    Path("afile.txt").write_text("notes")
    with pytest.raises(ConfigError) as e:
        SmartCkptConfig(root="afile.txt")
    assert str(e.value) == (
        "root='afile.txt' is invalid: it is a file, not a directory; the store is a folder (catalog.db and one folder "
        "per task): pass a folder path, new or existing, such as root='smart_ckpt', or leave root unset for "
        "<output_dir>/smart_ckpt.")
    with pytest.raises(ConfigError, match=r"^root='afile.txt/store' is invalid: 'afile.txt' is a file, not a dir"):
        SmartCkptConfig(root="afile.txt/store")
    config = SmartCkptConfig(root="later.txt")
    Path("later.txt").write_text("made after the config")  # the path a run resolves is checked again
    with pytest.raises(ConfigError, match=r"^root='later.txt' is invalid: it is a file, not a directory"):
        config.resolve_root("out")
    with pytest.raises(ConfigError) as e:
        SmartCkptConfig().resolve_root("afile.txt")
    assert str(e.value) == (
        "output_dir='afile.txt' is invalid: it is a file, not a directory; the store is a folder (catalog.db and one "
        "folder per task): pass a folder path, new or existing (the store goes under <output_dir>/smart_ckpt).")
    assert SmartCkptConfig(root="new/store").resolve_root(None) == "new/store"
    assert SmartCkptConfig().resolve_root("out") == "out/smart_ckpt"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile.txt", "later.txt"]  # nothing was created
    with pytest.raises(ConfigError) as e:  # the store opened directly says the same, not "not writable"
        CheckpointStore("afile.txt")
    assert str(e.value) == (f"root='{tmp_path / 'afile.txt'}' is invalid: it is a file, not a directory; pass the "
                            "store's directory (new or existing), e.g. the folder next to it.")


def test_replace_with_a_group_mapping_changes_only_the_keys_it_names() -> None:
    config = SmartCkptConfig(policy={"min_interval": 2, "max_interval": 50},
                             storage_levels={"level_1": {"compression_level": 3}})
    changed = config.replace(policy={"max_interval": 60}, storage_levels={"level_1": {"retention_days": 2}})
    assert (changed.policy.min_interval, changed.policy.max_interval) == (2, 60)
    assert (changed.storage_levels.level_1.compression_level, changed.storage_levels.level_1.retention_days) == (3, 2)
    assert changed.storage_levels.level_0 == config.storage_levels.level_0
    with pytest.raises(ConfigError, match=r"^policy\.max_interval=1 is invalid: expected an integer >= min_interval"):
        config.replace(policy={"max_interval": 1})
    with pytest.raises(UnknownConfigKeyError, match=r"^unknown config key policy\.'max_intervall' \(did you mean"):
        config.replace(policy={"max_intervall": 1})


@pytest.mark.parametrize("recipe", sorted(Path(__file__).resolve().parents[2].glob("recipes/*/checkpoint_config.yaml")))
def test_the_recipes_configs_load(recipe: Path) -> None:
    config = SmartCkptConfig.from_yaml(recipe)
    assert config.policy.risk_threshold == 0.68 and config.keep_last == 3
