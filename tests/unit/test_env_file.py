"""The one `.env` the worker reads: beside `src/` (the checkout's root, `/.env` in the image), wherever
the process runs, and never over a variable already set (docs/configuration.md, "Worker settings")."""

import json
import logging
import os
import subprocess
import sys

from conftest import REPO

CODE = """
import json, os, handler
found = handler.load_env_file()
print(json.dumps([str(handler.ENV_FILE), found, os.environ.get("WHERE"), os.environ.get("MINE")]))
"""


def run_handler_copy(tmp_path, files: dict[str, str], code: str = CODE, **env: str) -> list:
    """``code`` (default: ``handler.load_env_file()``) on a copy of src/handler.py at ``tmp_path/app/src``, run from
    ``tmp_path/elsewhere`` (as the local endpoint runs its workers, in a temporary folder), with
    ``files`` ({relative path: text}) written under ``tmp_path``."""
    src = tmp_path / "app" / "src"
    src.mkdir(parents=True)
    (src / "handler.py").write_text((REPO / "src" / "handler.py").read_text())
    (src / "worker").symlink_to(REPO / "src" / "worker")
    (tmp_path / "elsewhere").mkdir()
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    clean = {k: v for k, v in os.environ.items() if k not in ("WHERE", "MINE", "PYTHONPATH", "LOG_LEVEL")}
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path / "elsewhere", capture_output=True,
                            text=True, check=True, env=clean | {"PYTHONPATH": str(src)} | env)
    return json.loads(result.stdout)


def test_the_worker_reads_the_env_file_beside_src_only(tmp_path):
    files = {"app/.env": "WHERE=root\nMINE=from-file\n", "app/src/.env": "WHERE=src\n",
             "elsewhere/.env": "WHERE=cwd\n", ".env": "WHERE=above\n"}
    path, found, where, mine = run_handler_copy(tmp_path, files)
    assert path == str(tmp_path / "app" / ".env") and found
    assert (where, mine) == ("root", "from-file")


def test_the_real_environment_wins_over_the_env_file(tmp_path):
    _, found, where, mine = run_handler_copy(tmp_path, {"app/.env": "WHERE=root\nMINE=from-file\n"}, MINE="real")
    assert found and (where, mine) == ("root", "real")


def test_no_env_file_beside_src_reads_none_elsewhere(tmp_path):
    _, found, where, _ = run_handler_copy(tmp_path, {"elsewhere/.env": "WHERE=cwd\n", "app/src/.env": "WHERE=src\n"})
    assert (found, where) == (False, None)


def test_log_level_in_the_env_file_sets_the_workers_logging(tmp_path):
    code = "import json, logging, handler\nhandler.set_up_process()\nprint(json.dumps([logging.getLogger().level]))"
    assert run_handler_copy(tmp_path, {"app/.env": "LOG_LEVEL=debug\n"}, code) == [logging.DEBUG]
    assert run_handler_copy(tmp_path / "real", {"app/.env": "LOG_LEVEL=debug\n"}, code,
                            LOG_LEVEL="WARNING") == [logging.WARNING]


def test_the_checkouts_env_file_is_its_root_and_ignored_by_git():
    """In the image, /src/handler.py reads /.env; in the checkout, the root's .env, which git ignores."""
    import handler

    assert handler.ENV_FILE == REPO / ".env"
    assert "/.env" in (REPO / ".gitignore").read_text().split()
