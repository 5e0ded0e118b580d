"""Where profiles come from: the shipped ones (cluster/sim/profiles/*.json, measured by `duet profile`
on this kind of CPU), roofline estimates by name, or a file."""

from __future__ import annotations

import json
from pathlib import Path

from cluster.sim.profile import ProfileError, StepProfile
from cluster.sim.roofline import roofline_profile_from_spec

PROFILES_DIR = Path(__file__).resolve().parent / "profiles"


def shipped_profiles() -> dict[str, Path]:
    """The profiles that ship with duet, by name (file stem)."""
    return {path.stem: path for path in sorted(PROFILES_DIR.glob("*.json"))}


def load_profile(name_or_path: str | Path) -> StepProfile:
    """A profile by shipped name (`cpu-builtin`), by roofline spec (`roofline:h100-sxm:llama-3-8b`),
    or by path to a JSON file."""
    text = str(name_or_path)
    if text.startswith("roofline:"):
        return roofline_profile_from_spec(text)
    shipped = shipped_profiles()
    path = shipped.get(text, Path(text))
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ProfileError(f"{text}: no such file, and not a shipped profile ({', '.join(shipped) or 'none'})") from None
    except (OSError, json.JSONDecodeError) as error:
        raise ProfileError(f"{text}: {error}") from None
    return StepProfile.from_dict(data)
