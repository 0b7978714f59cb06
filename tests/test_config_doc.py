"""docs/configuration.md is generated from the configuration's own help and kept current; a
removed setting, in a YAML file or as a flag, gets a message that says what to use instead."""

import pytest

from app import config_doc
from app.config import FIELDS, ConfigError, load_config


def test_the_configuration_page_is_current():
    page = config_doc.PAGE.read_text() if config_doc.PAGE.exists() else ""
    assert page == config_doc.markdown(), (
        "docs/configuration.md is stale: run `python -m app.config_doc` and commit the page"
    )


def test_the_page_lists_every_setting_by_section():
    page = config_doc.markdown()
    for name, f in FIELDS.items():
        assert f"| `--{name.replace('_', '-')}` | `{name}` |" in page
        assert f"## {f.metadata['group']}" in page


def test_a_removed_setting_says_what_to_use_instead(tmp_path):
    with pytest.raises(ConfigError, match="--auto-cache: 'auto_cache' was removed; set the "):
        load_config(["--auto-cache", "/tmp/cache"])
    old = tmp_path / "old.yaml"
    old.write_text("auto_cache: /tmp/cache\nepochs: 3\n")
    with pytest.raises(ConfigError, match="IRONGRAIN_CACHE_DIR"):
        load_config(["--config", str(old)])
    old.write_text("auto_cache: ''\nepochs: 3\n")  # an old run's config.yaml: still read
    assert load_config(["--config", str(old)]).epochs == 3
