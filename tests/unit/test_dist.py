"""A finished rank ends through ``finish_rank``: its exit status and its last output survive."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.unit


def test_finish_rank_keeps_exit_status_and_buffered_output(tmp_path):
    # Buffered stdout (a pipe) and a logging file handler, with a live 1-rank gloo group: the
    # os._exit that skips the teardown must lose neither.
    script = textwrap.dedent(
        f"""
        import logging, sys
        from hybrid_rl.dist import finish_rank, init_distributed
        logging.basicConfig(filename={str(tmp_path / "log.txt")!r}, level=logging.INFO)
        init_distributed("cpu")
        logging.getLogger("x").info("logged before exit")
        sys.stdout.write("printed without a newline or flush")
        finish_rank(3)
        print("not reached")
        """
    )
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False)
    assert p.returncode == 3, p.stderr
    assert p.stdout == "printed without a newline or flush"
    assert "logged before exit" in (tmp_path / "log.txt").read_text()
