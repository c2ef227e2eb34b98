"""Ray's token file (``~/.ray/auth_token``) is readable by its owner only, whoever creates it: an embedded Ray
started by this code finds it created 0600 (Ray itself would write it with the umask's 0644); `compat cluster up`
makes a readable one of its user 0600, saying so, and refuses one of another user that others can read. Each case
runs in its own process with a temporary HOME."""
from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

import pytest
from user_shell import PYTHON, compat
from user_shell import user_env as _env

EMBEDDED = """
import os, ray
os.umask(0o022)
from cluster.ray.task_backend import connect
assert connect(num_cpus=1) is True
ray.shutdown()
"""

ENSURE = """
import os
os.umask(0o022)
from cluster.ray.local_head import ensure_token
print(ensure_token())
"""


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_an_embedded_ray_finds_its_token_file_created_owner_only(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    done = subprocess.run([PYTHON, "-c", EMBEDDED], env=_env(home), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    token = home / ".ray" / "auth_token"
    assert token.is_file() and _mode(token) == 0o600
    assert len(token.read_text().strip()) >= 32


def test_cluster_up_secures_a_readable_token_of_its_user_and_refuses_another_users(tmp_path):
    home = tmp_path / "home"
    token = home / ".ray" / "auth_token"
    token.parent.mkdir(parents=True)
    token.write_text("0" * 64)
    token.chmod(0o644)
    done = subprocess.run([PYTHON, "-c", ENSURE], env=_env(home), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert _mode(token) == 0o600 and token.read_text() == "0" * 64   # the same token, now owner only
    assert f"the Ray token file {token} was readable by other users (-rw-r--r--); made it 0600" in done.stderr

    if os.getuid() != 0:
        pytest.skip("giving the token file to another user needs root")
    other = 65534   # another user's file, readable by everyone
    token.chmod(0o644)
    os.chown(token, other, -1)
    refused = compat("cluster", "up", "--name", "token-check", "--state-dir", str(tmp_path / "state"),
                     env=_env(home), timeout=120)
    assert refused.returncode == 1
    assert f"the Ray token file {token} belongs to uid {other}" in refused.stderr
    assert "it is not used" in refused.stderr and "0" * 64 not in refused.stdout + refused.stderr
    assert _mode(token) == 0o644 and not (tmp_path / "state" / "token-check.json").exists()
