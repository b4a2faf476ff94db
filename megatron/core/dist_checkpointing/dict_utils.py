"""Walking nested state dicts (dicts and lists of values)."""

from typing import Any, Callable, Dict, Iterator, List, Tuple, Union

import torch

Nested = Union[Dict[str, Any], List[Any]]


def extract_matching_values(
    x: Nested, predicate: Callable[[Any], bool], return_lists_as_dicts: bool = False
) -> Tuple[Nested, Nested]:
    """Split ``x`` into (values where ``predicate`` holds, the rest), keeping the nesting.

    Empty containers are dropped from both parts. With ``return_lists_as_dicts`` a list
    becomes a dict from index to value (so that partial lists keep their positions).
    """

    items = enumerate(x) if isinstance(x, list) else x.items()
    matched, other = {}, {}
    for key, v in items:
        if isinstance(v, (dict, list)):
            m, o = extract_matching_values(v, predicate, return_lists_as_dicts)
            if m:
                matched[key] = m
            if o:
                other[key] = o
        elif predicate(v):
            matched[key] = v
        else:
            other[key] = v
    if isinstance(x, list) and not return_lists_as_dicts:
        return list(matched.values()), list(other.values())
    return matched, other


def dict_list_map_inplace(f: Callable[[Any], Any], x: Nested) -> Nested:
    """Replace every leaf ``v`` of ``x`` with ``f(v)`` in place; returns ``x``."""
    if isinstance(x, dict):
        for k, v in x.items():
            x[k] = dict_list_map_inplace(f, v)
    elif isinstance(x, list):
        x[:] = [dict_list_map_inplace(f, v) for v in x]
    else:
        return f(x)
    return x


def dict_list_map_outplace(f: Callable[[Any], Any], x: Nested) -> Nested:
    """A new nesting with every leaf ``v`` replaced by ``f(v)``."""
    if isinstance(x, dict):
        return {k: dict_list_map_outplace(f, v) for k, v in x.items()}
    if isinstance(x, list):
        return [dict_list_map_outplace(f, v) for v in x]
    return f(x)


def nested_values(x: Nested) -> Iterator[Any]:
    """Every leaf of ``x``."""
    for v in x.values() if isinstance(x, dict) else x:
        if isinstance(v, (dict, list)):
            yield from nested_values(v)
        else:
            yield v


def nested_items_iter(x: Nested) -> Iterator[Tuple[Any, Any]]:
    """Every (key, leaf) pair of ``x`` (the key is the leaf's own key or index)."""
    for k, v in x.items() if isinstance(x, dict) else enumerate(x):
        if isinstance(v, (dict, list)):
            yield from nested_items_iter(v)
        else:
            yield k, v


def merge(x1: Nested, x2: Nested, key: Tuple[str, ...] = ()) -> Nested:
    """Merge ``x2`` into ``x1`` in place (dicts by key, lists by position); returns ``x1``.

    Lists may be given as dicts from index to value (``extract_matching_values`` with
    ``return_lists_as_dicts``).
    """
    if isinstance(x1, dict) and isinstance(x2, dict):
        for k, v2 in x2.items():
            if k not in x1:
                x1[k] = v2
            else:
                x1[k] = merge(x1[k], v2, key + (str(k),))
    elif isinstance(x1, list) and isinstance(x2, (list, dict)):
        items = x2.items() if isinstance(x2, dict) else enumerate(x2)
        for i, v2 in items:
            if i < len(x1):
                x1[i] = merge(x1[i], v2, key + (str(i),))
            elif i == len(x1):
                x1.append(v2)
            else:
                raise ValueError(f"merge at {key}: index {i} beyond list of length {len(x1)}")
    else:
        raise ValueError(
            f"merge at {key}: cannot merge {type(x2).__name__} into {type(x1).__name__}"
        )
    return x1


def diff(x1: Any, x2: Any, prefix: Tuple = ()) -> Tuple[list, list, list]:
    """(keys only in x1, keys only in x2, keys whose values differ), as key paths."""
    mismatch: list = []
    if isinstance(x1, dict) and isinstance(x2, dict):
        only_left = [prefix + (k,) for k in x1.keys() - x2.keys()]
        only_right = [prefix + (k,) for k in x2.keys() - x1.keys()]
        for k in x1.keys() & x2.keys():
            left, right, sub = diff(x1[k], x2[k], prefix + (k,))
            only_left += left
            only_right += right
            mismatch += sub
        return only_left, only_right, mismatch
    if isinstance(x1, list) and isinstance(x2, list):
        only_left = [prefix + (i,) for i in range(len(x2), len(x1))]
        only_right = [prefix + (i,) for i in range(len(x1), len(x2))]
        for i, (a, b) in enumerate(zip(x1, x2)):
            left, right, sub = diff(a, b, prefix + (i,))
            only_left += left
            only_right += right
            mismatch += sub
        return only_left, only_right, mismatch
    if isinstance(x1, torch.Tensor) and isinstance(x2, torch.Tensor):
        same = x1.shape == x2.shape and x1.dtype == x2.dtype and torch.equal(x1.cpu(), x2.cpu())
    elif isinstance(x1, torch.Tensor) or isinstance(x2, torch.Tensor):
        same = False
    else:
        try:
            same = bool(x1 == x2)
        except Exception:  # noqa: BLE001 - objects whose == is not a bool
            same = False
    return [], [], ([] if same else [prefix])
