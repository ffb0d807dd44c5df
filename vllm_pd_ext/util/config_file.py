"""Reading a YAML or JSON config file (``vllm-pd up --config``, ``vllm-pd proxy --config``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml


def read_mapping(path: Path) -> dict[str, Any]:
    """A YAML or JSON file holding one mapping."""
    text = path.read_text(encoding="utf-8")
    data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a mapping at the top level")
    return data
