"""`forerun chat` driven through a pseudo-terminal: two turns, /method, /reset, Ctrl-C stops only the answer."""

import shutil
import sys
from pathlib import Path

import pexpect
import pytest

pytestmark = pytest.mark.real_model


def forerun_command() -> str:
    found = shutil.which("forerun") or str(Path(sys.executable).parent / "forerun")
    return found


def test_two_turns_method_switch_reset_and_ctrl_c():
    child = pexpect.spawn(
        forerun_command(),
        ["chat", "--max-new-tokens", "60", "--threads", "2"],
        timeout=180,
        encoding="utf-8",
        dimensions=(40, 160),
    )
    try:
        child.expect("forerun chat")
        child.expect("you>")
        child.sendline("What is the capital of France?")
        child.expect("bot>")
        child.expect("tokens/forward")
        child.expect("you>")
        child.sendline("/method jacobi")
        child.expect("method: jacobi")
        child.expect("you>")
        child.sendline("And of Italy?")
        child.expect("tokens/forward")
        child.expect("you>")
        child.sendline("/method warp")
        child.expect("unknown method 'warp'")
        child.expect("you>")
        child.sendline("/reset")
        child.expect("history cleared")
        child.expect("you>")
        child.sendline("Write a very long poem about the sea.")
        child.expect("bot>")
        child.sendintr()  # Ctrl-C: stops this answer, the chat goes on
        child.expect(r"\(stopped\)")
        child.expect("tokens/forward")
        child.expect("you>")
        child.sendline("/quit")
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    assert child.exitstatus == 0, child.before
