"""The run a view records, as code that derives from it needs it: its resolved config (config.json)
and its digest chain, rebuilt from the view's own prepare record and runtime without loading a model
(`opd stage export` with export.policy=best finds the run's evaluation this way; `opd gc` what the
run reaches)."""
from __future__ import annotations

from pathlib import Path

from ..errors import UserError
from .config import Config, from_container
from .identity import Chain
from .store import read_json


def config(run_dir: Path) -> Config | None:
    """The resolved config the run trained with (config.json, written as it starts training), or None
    if there is none; a file that is no config of this version is a UserError naming it."""
    data = read_json(run_dir / "config.json")
    return None if data is None else from_container(data, str(run_dir / "config.json"))


def chain(cfg: Config | None, view: dict) -> Chain | None:
    """The digest chain of the run `view` records, under its recorded config `cfg`. None where there is
    no config or it does not give the view's policies (a run made by another version of the stages)."""
    if cfg is None:
        return None
    d = view["digests"]
    c = Chain(cfg, lambda: view["runtime"], d["prepared"])
    try:
        same = (c.policy(0), c.policy(view["updates"])) == (d["initial_policy"], d["final_policy"])
    except (KeyError, UserError):  # a record of another version (a key it lacks)
        return None
    return c if same else None
