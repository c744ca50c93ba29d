"""verl 0.8.0's config fields, as a snapshot we ship, so mapping a verl config needs no verl install.

`verl-0.8.0-fields.json` lists every leaf of verl's composed PPO trainer config
(`verl/trainer/config/_generated_ppo_trainer.yaml`) with its default, interpolations unresolved.
`python -m stages.verl.fields` regenerates it from an installed verl; a conformance test checks the
shipped file against the installed verl byte for byte.
"""
from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import Any

VERL_VERSION = "0.8.0"
SNAPSHOT = Path(__file__).with_name(f"verl-{VERL_VERSION}-fields.json")
SOURCE = "verl/trainer/config/_generated_ppo_trainer.yaml"


def leaves(tree: Any, prefix: str = "") -> dict[str, Any]:
    """{dotted.key: value} for every leaf; an empty mapping is a leaf (an open dict in verl)."""
    if isinstance(tree, dict) and tree:
        out: dict[str, Any] = {}
        for k, v in tree.items():
            out.update(leaves(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    return {prefix: tree}


def unflatten(flat: dict[str, Any]) -> dict:
    out: dict = {}
    for key, value in flat.items():
        node = out
        *parents, last = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = value
    return out


def _user_leaf(key: str) -> bool:
    # `_target_` names verl's dataclass for instantiation; it is plumbing, not a setting
    return not key.split(".")[-1] == "_target_"


def generate() -> str:
    """The snapshot text from the installed verl (needs `pip install --no-deps verl==0.8.0`)."""
    import verl
    from omegaconf import OmegaConf

    if verl.__version__ != VERL_VERSION:
        raise RuntimeError(f"installed verl is {verl.__version__}; the snapshot is for {VERL_VERSION}")
    tree = OmegaConf.to_container(OmegaConf.load(Path(verl.__file__).parent / SOURCE.removeprefix("verl/")),
                                  resolve=False)
    flat = {k: v for k, v in leaves(tree).items() if _user_leaf(k)}
    return json.dumps({"verl_version": VERL_VERSION, "source": SOURCE, "fields": flat}, indent=1,
                      sort_keys=False) + "\n"


@lru_cache(maxsize=1)
def defaults() -> dict[str, Any]:
    """{verl leaf: default} in verl's own order."""
    return json.loads(SNAPSHOT.read_text())["fields"]


def open_dicts() -> set[str]:
    """Leaves whose default is an empty mapping: verl accepts any keys below them."""
    return {k for k, v in defaults().items() if v == {}}


def known(key: str) -> str | None:
    """The snapshot leaf that `key` is (or lies under, for open dicts); None for an unknown field."""
    d = defaults()
    if key in d:
        return key
    parts = key.split(".")
    for i in range(len(parts) - 1, 0, -1):
        head = ".".join(parts[:i])
        if head in d and d[head] == {}:
            return head
    return None


if __name__ == "__main__":
    SNAPSHOT.write_text(generate())
    print(f"wrote {SNAPSHOT} ({len(defaults.__wrapped__())} fields)")
