"""docs/index.md from README.md (the front page is written once), its links made relative to docs/; `make docs`."""

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
text = (ROOT / "README.md").read_text(encoding="utf-8")
text = text.replace("](docs/", "](").replace("[CHANGELOG.md](CHANGELOG.md)", "`CHANGELOG.md` in the repository")
(ROOT / "docs" / "index.md").write_text(text, encoding="utf-8")
