"""Pages generated for the documentation site (`make docs`): docs/index.md from README.md (the front page is
written once, its links made relative to docs/), and docs/cli-reference.md from the command line's own help."""

from pathlib import Path

from typer.main import get_command
from typer.testing import CliRunner

from forerun.cli import app

ROOT = Path(__file__).resolve().parent.parent


def index() -> str:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    return text.replace("](docs/", "](").replace("[CHANGELOG.md](CHANGELOG.md)", "`CHANGELOG.md` in the repository")


def cli_reference() -> str:
    """Every command's `--help`, as the installed CLI prints it."""
    runner, root = CliRunner(), get_command(app)
    parts = ["# CLI reference\n", "Generated from `forerun COMMAND --help` when the site is built.\n"]
    for name, command in root.commands.items():
        paths = [[name, sub] for sub in getattr(command, "commands", {})] or [[name]]
        for path in paths:
            shown = runner.invoke(
                app, [*path, "--help"], prog_name="forerun", terminal_width=100, env={"NO_COLOR": "1", "COLUMNS": "100"}
            )
            parts.append(f"## forerun {' '.join(path)}\n\n```text\n{shown.output.rstrip()}\n```\n")
    return "\n".join(parts)


(ROOT / "docs" / "index.md").write_text(index(), encoding="utf-8")
(ROOT / "docs" / "cli-reference.md").write_text(cli_reference(), encoding="utf-8")
