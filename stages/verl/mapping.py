"""Profiles in: a verl-shaped OPD config -> our Hydra overrides, with every leaf classified.

The verl config a profile runs is, in order of precedence (later wins):
    verl 0.8.0's own defaults (fields.py snapshot)
    the profile's base (conf/profile/NAME.yaml `verl:`): single-GPU values and the profile's loss
    the config (--config FILE, or builtin:PAIR: the pair's model paths)
    --set key=value (verl keys)
Every leaf of the result is classified by rules.py; an unsupported value fails closed naming the
field; a reinterpreted leaf whose value came from an external file or --set must be accepted
(--accept FIELD or --accept all). Leaves still at verl's defaults count too (they are what verl
would run), so a profile's base must make them supportable. Then the profile's pins are checked: a
config may not change what makes the profile what it is (its loss, for instance).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from ..run.config import ROOT, read_yaml
from ..errors import UserError
from . import fields, rules

PROFILE_DIR = ROOT / "conf" / "profile"
PAIR_DIR = ROOT / "conf" / "pair"
SOURCES = ("default", "profile", "builtin", "config", "set")


# ---- profiles and builtin pairs ----
def profile_names() -> list[str]:
    """Profiles are conf/profile/NAME.yaml; files starting with "_" are shared bases, not profiles."""
    return sorted(p.stem for p in PROFILE_DIR.glob("*.yaml") if not p.stem.startswith("_"))


def load_profile(name: str) -> dict:
    p = PROFILE_DIR / f"{name}.yaml"
    if not p.is_file() or name.startswith("_"):
        raise UserError(f"unknown profile {name!r}; expected one of {', '.join(profile_names())}")
    data = _load_with_base(p, set())
    return {"name": name, "file": str(p.relative_to(ROOT)), **data}


def _load_with_base(p: Path, seen: set) -> dict:
    """A profile file merged onto the file it `extends` (mappings merge, anything else is replaced)."""
    data = yaml.safe_load(p.read_text()) or {}
    parent = data.pop("extends", None)
    if parent is None:
        return data
    if parent in seen:
        raise UserError(f"{p}: 'extends' cycle through {parent!r}")
    base = _load_with_base(PROFILE_DIR / f"{parent}.yaml", seen | {parent})
    return OmegaConf.to_container(OmegaConf.merge(base, data), resolve=False)


def pair_names() -> list[str]:
    return sorted(p.stem for p in PAIR_DIR.glob("*.yaml"))


def load_pair(name: str) -> dict:
    """A builtin model pair: conf/pair/NAME.yaml (a Hydra group file of ours: `+pair=NAME` works too)."""
    p = PAIR_DIR / f"{name}.yaml"
    if not p.is_file():
        raise UserError(f"--config builtin:{name}: unknown builtin pair; expected one of {', '.join(pair_names())}")
    return yaml.safe_load(p.read_text())


def pair_config(name: str) -> tuple[dict, list[str]]:
    """(verl-shaped config naming the pair's models, our overrides the verl schema cannot express:
    pinned revisions, layer pruning)."""
    pair = load_pair(name)
    verl_cfg = {"actor_rollout_ref": {"model": {"path": pair["student"]["name"]}},
                "distillation": {"teacher_models": {"teacher_model": {"model_path": pair["teacher"]["name"]}}}}
    extra = [f"{role}.{k}={_fmt(v)}" for role in ("student", "teacher")
             for k, v in pair[role].items() if k != "name"]
    return verl_cfg, extra


# ---- flattening that respects verl's open dicts ----
def _flat(tree: Any, prefix: str = "") -> dict[str, Any]:
    """Leaves of a verl-shaped tree; a mapping under one of verl's open-dict fields stays one value."""
    opens = fields.open_dicts()
    if isinstance(tree, dict) and tree and prefix not in opens:
        out: dict[str, Any] = {}
        for k, v in tree.items():
            out.update(_flat(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    return {prefix: tree} if prefix else {}


def _drop_plumbing(flat: dict) -> dict:
    return {k: v for k, v in flat.items() if k.split(".")[-1] != "_target_" and k.split(".")[0] != "defaults"}


def parse_sets(sets: list[str]) -> dict:
    out = {}
    for s in sets:
        key, eq, raw = s.partition("=")
        if not eq or not key.strip():
            raise UserError(f"--set {s!r}: expected key=value (a verl field, e.g. data.train_batch_size=8)")
        try:  # OmegaConf's YAML, as for config files (it reads 1e-4 as a float, PyYAML does not)
            out[key.strip().lstrip("+")] = OmegaConf.to_container(OmegaConf.create(f"v: {raw}"))["v"] \
                if raw.strip() else None
        except Exception:
            raise UserError(f"--set {s!r}: value is not valid YAML") from None
    return out


def read_config_file(path: str) -> dict:
    return read_yaml(path, f"--config {path}", of=" of verl fields")


# ---- the mapping ----
def map_profile(profile: str, config: str, sets: list[str] | None = None,
                accept: list[str] | None = None) -> tuple[list[str], dict]:
    """-> (our Hydra overrides, report). Raises UserError (one line, naming the field) on bad input."""
    prof = load_profile(profile)
    layers: list[tuple[str, dict]] = [("default", fields.unflatten(fields.defaults())),
                                      ("profile", prof.get("verl") or {})]
    extra: list[str] = []
    if config.startswith("builtin:"):
        verl_cfg, extra = pair_config(config.removeprefix("builtin:"))
        layers.append(("builtin", verl_cfg))
    else:
        layers.append(("config", read_config_file(config)))
    set_flat = parse_sets(sets or [])
    layers.append(("set", fields.unflatten(set_flat)))

    source: dict[str, str] = {}
    for name, tree in layers:
        for key in _drop_plumbing(_flat(tree)):
            source[key] = name
    for key, src in source.items():  # unknown fields first: a typo must not be classified as anything
        other_teacher = key.startswith("distillation.teacher_models.") and key.split(".")[2] != "teacher_model"
        if src != "default" and fields.known(key) is None and not other_teacher:  # other teachers: unsupported
            raise UserError(f"{_where(src, config)}: unknown verl field '{key}' (not in verl {fields.VERL_VERSION}'s "
                            "config; see docs/compat.md)")
    try:
        merged = OmegaConf.merge(*[OmegaConf.create(t) for _, t in layers])
        ctx = _drop_plumbing(_flat(OmegaConf.to_container(merged, resolve=True)))
    except OmegaConfBaseException as e:
        raise UserError(f"verl config: {str(e).splitlines()[0]}") from None

    accepted = set(accept or [])
    ours: dict[str, Any] = {}
    by: dict[str, str] = {}
    entries = []
    for key, value in ctx.items():
        rule = rules.rule_for(key)
        src = source.get(key, "default")
        if rule.kind == rules.UNSUP:
            raise UserError(f"{_where(src, config)}: verl field '{key}' = {value!r} is unsupported: {rule.note}")
        if rule.allowed is not None and not rule.allowed.test(value, ctx):
            raise UserError(f"{_where(src, config)}: verl field '{key}' = {value!r} is unsupported here; "
                            f"expected {rule.allowed.desc}" + (f" ({rule.note})" if rule.note else ""))
        mapped = rule.convert(value, ctx) if rule.convert else {k: value for k in rule.ours}
        if rule.kind == rules.REINTERP and src in ("config", "set") and not ({"all", key} & accepted):
            raise UserError(f"{_where(src, config)}: verl field '{key}' is reinterpreted here ({rule.note}); "
                            f"accept it with --accept {key} (or --accept all)")
        for our_key, our_value in mapped.items():
            if our_key in ours and ours[our_key] != our_value:
                raise UserError(f"verl fields '{by[our_key]}' and '{key}' disagree on our key '{our_key}' "
                                f"({ours[our_key]!r} vs {our_value!r})")
            ours[our_key], by[our_key] = our_value, key
        if src != "default" or mapped:
            entries.append({"field": key, "value": value, "class": rule.kind, "ours": mapped, "source": src,
                            "rule": rule.pattern, "note": rule.note})
    _check_pins(prof, ctx, source, config)
    overrides = [f"{k}={_fmt(v)}" for k, v in ours.items()] + extra + list(prof.get("opd_overrides") or [])
    counts = {k: sum(e["class"] == k for e in entries) for k in rules.KINDS}
    report = {"profile": profile, "profile_file": prof["file"], "config": config, "sets": list(sets or []),
              "accept": sorted(accepted), "verl_version": fields.VERL_VERSION, "fields": entries,
              "counts": counts, "defaults_informational": sum(1 for k in ctx if source.get(k, "default") == "default"
                                                              and not any(e["field"] == k for e in entries)),
              "overrides": overrides}
    return overrides, report


def _check_pins(prof: dict, ctx: dict, source: dict, config: str) -> None:
    base = _flat(prof.get("verl") or {})
    for key in prof.get("pin") or []:
        want = base.get(key, fields.defaults().get(key))
        if ctx.get(key) != want:
            raise UserError(f"{_where(source.get(key, 'default'), config)}: verl field '{key}' = {ctx.get(key)!r} "
                            f"conflicts with profile {prof['name']} (it pins {want!r}; pick another profile)")
    for key, lo in (prof.get("at_least") or {}).items():
        if not (isinstance(ctx.get(key), (int, float)) and ctx[key] >= lo):
            raise UserError(f"{_where(source.get(key, 'default'), config)}: verl field '{key}' = {ctx.get(key)!r}; "
                            f"profile {prof['name']} needs >= {lo}")
    for key, hi in (prof.get("at_most") or {}).items():
        if not (isinstance(ctx.get(key), (int, float)) and ctx[key] <= hi):
            raise UserError(f"{_where(source.get(key, 'default'), config)}: verl field '{key}' = {ctx.get(key)!r}; "
                            f"profile {prof['name']} needs <= {hi} (use its grouped variant)")


def _where(src: str, config: str) -> str:
    return {"config": config, "set": "--set", "builtin": config, "profile": "profile",
            "default": f"verl {fields.VERL_VERSION} default"}.get(src, src)


def _fmt(v: Any) -> str:
    """A value as Hydra override syntax."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, (list, tuple)):
        return "[" + ",".join(_fmt(x) for x in v) + "]"
    s = str(v)
    if s and all(c.isalnum() or c in "_-./:@~" for c in s) and s not in ("null", "true", "false") \
            and not _numeric(s):
        return s
    return "'" + s.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _numeric(s: str) -> bool:
    try:
        float(s)
        return True
    except ValueError:
        return False
