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
        # a fresh machine first measures its latency curve (a minute or two; several on a busy 2-core one)
        child.expect("forerun chat", timeout=900)
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


def test_a_line_of_invalid_utf8_is_refused_and_the_chat_goes_on():
    """printf 'Say hi\\n\\xff\\xfe bad\\nSay hi\\n' | forerun chat: the bad line kept every later turn failing."""
    import subprocess

    done = subprocess.run(
        [forerun_command(), "chat", "--max-new-tokens", "8", "--threads", "2"],
        input=b"Say hi\n\xff\xfe bad\nSay hi\n",
        capture_output=True,
        timeout=300,
    )
    output = done.stdout.decode("utf-8", "replace")
    assert done.returncode == 0, output + done.stderr.decode("utf-8", "replace")
    assert "lone surrogate" in output and "not sent" in output
    assert output.count("bot> ") == 2 and "error:" not in output  # both good turns answered
    assert "error:" not in output


def test_a_sampled_chat_answers_what_the_python_api_draws_with_its_seed(smollm2):
    """`forerun chat --sample --temperature 0.9 --seed 5`: the answer is `generate(messages, do_sample=True, ...,
    seed=5)`'s, streamed; another seed answers otherwise."""
    import subprocess

    import forerun

    model, tokenizer = smollm2
    messages = [{"role": "user", "content": "Tell me a short story about a cat."}]
    expected = forerun.Decoder(model, tokenizer, "prompt_lookup").generate(
        messages, 24, do_sample=True, temperature=0.9, seed=5
    )
    answers = {}
    for seed in ("5", "6"):
        args = ["chat", "--max-new-tokens", "24", "--threads", "2", "--sample", "--temperature", "0.9", "--seed", seed]
        done = subprocess.run(
            [forerun_command(), *args], input=b"Tell me a short story about a cat.\n", capture_output=True, timeout=300
        )
        answers[seed] = done.stdout.decode("utf-8", "replace")
        assert done.returncode == 0, answers[seed] + done.stderr.decode("utf-8", "replace")
    first_line = expected.text.strip().splitlines()[0]
    assert first_line in answers["5"] and first_line not in answers["6"]
