"""EAGLE-3 heads shipped inside augury (see each folder's README.md model card)."""
from __future__ import annotations

from pathlib import Path

DEMO_HEAD = Path(__file__).parent / "smollm2-135m-instruct-eagle3"


def demo_head_dir() -> Path | None:
    """The head trained for the demo target, or None if this build ships none."""
    return DEMO_HEAD if (DEMO_HEAD / "config.json").is_file() else None
