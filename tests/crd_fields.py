"""Unknown-field check for Prometheus Operator objects.

The validators compiled from the CRD schemas (tests/k8s/validate_monitoring.mjs) check
types, required fields and enums, but like the CRDs they accept unknown keys, so a
misspelt field would pass silently (and be pruned by the API server). The same package
ships TypeScript interfaces generated from those schemas; their field lists are the CRD
field layout, and this module walks an object through them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

MODELS = (
    Path(__file__).parent
    / "k8s"
    / "node_modules"
    / "@kubernetes-models"
    / "prometheus-operator"
    / "monitoring.coreos.com"
    / "v1"
)

_IMPORT = re.compile(r'^import \{ (\w+) \} from "\./(\w+)\.js";', re.M)
_INTERFACE = re.compile(r"^export interface (\w+)(?: extends ([\w, ]+))? \{\n(.*?)^\}", re.M | re.S)
_FIELD = re.compile(r'^    "([^"]+)"\??: (.+?);?$', re.M)


@dataclass
class Model:
    fields: dict[str, str] = field(default_factory=dict)
    refs: dict[str, str] = field(default_factory=dict)  # imported type alias -> file stem


def load(stem: str, _cache: dict[str, Model] = {}) -> Model:  # noqa: B006 - a memo
    if stem in _cache:
        return _cache[stem]
    text = (MODELS / f"{stem}.d.ts").read_text()
    model = Model(refs=dict(_IMPORT.findall(text)))
    m = _INTERFACE.search(text)
    if m is None:
        raise ValueError(f"no interface in {stem}.d.ts")
    for parent in filter(None, (p.strip() for p in (m.group(2) or "").split(","))):
        if parent in model.refs:
            model.fields.update(load(model.refs[parent]).fields)
    for name, kind in _FIELD.findall(m.group(3)):
        model.fields[name] = kind
    _cache[stem] = model
    return model


def unknown_fields(obj: dict, stem: str, path: str = "") -> list[str]:
    """Paths in ``obj`` that the model ``stem`` (e.g. "PodMonitorSpec") does not have."""
    model = load(stem)
    problems = []
    for key, value in obj.items():
        where = f"{path}.{key}" if path else key
        kind = model.fields.get(key)
        if kind is None:
            problems.append(f"{where}: not a field of {stem}")
            continue
        array = re.fullmatch(r"Array<(\w+)>", kind)
        alias = array.group(1) if array else kind
        target = model.refs.get(alias)
        if target is None:
            continue  # a plain value, a map, or an apimachinery type
        if array and isinstance(value, list):
            for i, item in enumerate(value):
                if isinstance(item, dict):
                    problems += unknown_fields(item, target, f"{where}[{i}]")
        elif isinstance(value, dict):
            problems += unknown_fields(value, target, where)
    return problems
