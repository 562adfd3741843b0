"""The README's promises that code can check: set-up commands, CI entry point, defaults."""

import re

from conftest import REPO

from worker.config.engine_args import WORKER_DEFAULTS
from worker.config.settings import WorkerSettings

README = (REPO / "README.md").read_text()


def test_ci_runs_the_readme_test_command():
    assert "scripts/test.sh" in README and "scripts/serve.sh" in README
    assert "scripts/test.sh" in (REPO / ".ci" / "run").read_text()


def test_readme_worker_setting_defaults_match_the_code():
    rows = dict(re.findall(r"^\| `([A-Z_]+)`[^|]*\| `([^`]*)` \|", README, re.MULTILINE))
    for field in WorkerSettings.model_fields.values():
        env_name = field.validation_alias.choices[0]
        if field.default is not None:
            assert env_name in rows, env_name
            assert rows[env_name] == str(field.default).lower().removesuffix(".0"), env_name


def test_readme_worker_defaults_match_the_code():
    for dest, value in WORKER_DEFAULTS.items():
        assert f"{dest}={value}" in README


