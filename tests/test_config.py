import pytest

from app.config import Config, ConfigError, build_parser, load_config


def test_defaults_follow_the_original_recipe():
    cfg = load_config([])
    assert (cfg.lr, cfg.weight_decay, cfg.batch_size, cfg.epochs) == (2e-4, 1e-4, 8, 100)
    assert cfg.milestones == [25, 50, 75] and cfg.gamma == 0.2
    assert cfg.patch_size == (32, 160, 160) and cfg.foreground_fraction == 0.33
    assert cfg.data_root == "datasets/IronGrain/74x320x320"
    assert cfg.fp32_ops == ["sigmoid", "softmax"]
    # decided on the machine that trains (app.precision.auto), not copied from the recipe's GPU
    assert (cfg.opt_level, cfg.amp_dtype, cfg.memory_format) == ("auto", "auto", "auto")
    assert cfg.auto_probe


def test_yaml_overrides_defaults_and_flags_override_yaml(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("epochs: 7\nlr: 2e-3\npatch_size: [8, 16, 16]\nbatch_size: 3\n")
    cfg = load_config(["--config", str(path), "--epochs", "9"])
    assert cfg.epochs == 9  # flag wins
    assert cfg.lr == 2e-3 and cfg.patch_size == (8, 16, 16) and cfg.batch_size == 3  # YAML wins
    assert cfg.weight_decay == Config().weight_decay  # default stays


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("epoch: 3\n", "unknown setting(s) ['epoch']"),
        ("epochs: many\n", "'epochs' must be int"),
        ("opt_level: O4\n", "'opt_level' must be one of"),
        ("- 1\n- 2\n", "expected a mapping"),
        ("epochs: [\n", "not valid YAML"),
    ],
)
def test_bad_yaml_names_the_file_and_setting(tmp_path, text, expected):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_config(["--config", str(path)])
    assert str(path) in str(err.value) and expected in str(err.value)


def test_missing_yaml_file_is_named(tmp_path):
    with pytest.raises(ConfigError, match=r"nope\.yaml"):
        load_config(["--config", str(tmp_path / "nope.yaml")])


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["--patch-size", "0", "16", "16"], "--patch-size"),
        (["--batch-size", "0"], "--batch-size"),
        (["--foreground-fraction", "1.5"], "--foreground-fraction"),
        (["--milestones", "50", "25"], "--milestones"),
        (["--sw-overlap", "1.0"], "--sw-overlap"),
        (["--resume", "somewhere"], "--resume"),
        (["--depth", "1"], "--depth"),
        (["--patch-size", "4", "32", "32", "--depth", "4"], "--patch-size"),
        (["--ema-decay", "1.0"], "--ema-decay"),
        (["--grad-clip", "-1"], "--grad-clip"),
        (["--augment-level", "rot90", "--patch-size", "16", "32", "48"], "--patch-size"),
        (["--num-classes", "3", "--data-access", "mmap"], "--data-access"),
    ],
)
def test_invalid_values_name_the_flag(argv, flag):
    with pytest.raises(ConfigError, match=flag):
        load_config(argv)


def test_bad_choice_exits_with_usage(capsys):
    with pytest.raises(SystemExit) as exit_info:
        load_config(["--amp-backend", "fast"])
    assert exit_info.value.code == 2
    assert "--amp-backend" in capsys.readouterr().err


def test_help_shows_defaults():
    text = build_parser().format_help()
    assert "--patch-size D H W" in text and "(default: 32 160 160)" in text
    assert "(default: 0.0002)" in text


def test_legacy_local_rank_flags_are_accepted():
    assert load_config(["--local_rank", "3"]).local_rank == 3
    assert load_config(["--local-rank", "1"]).local_rank == 1


def test_to_dict_is_plain_data():
    data = Config().to_dict()
    assert data["patch_size"] == [32, 160, 160]
    assert all(isinstance(v, (str, int, float, bool, list)) for v in data.values())
