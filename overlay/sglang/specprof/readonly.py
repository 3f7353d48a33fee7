"""A read-only copy of a closed window's summary: what every sink is handed.

`freeze` copies the dicts and lists of a summary into `ReadOnlyDict` / `ReadOnlyList`, whose
every change (setting, deleting, popping, appending, sorting in place...) raises TypeError.
They are a dict and a list to whatever reads them (`isinstance`, `json.dumps`, `==`), so a
sink reads them as it would the summary; a copy of one (`copy`, `deepcopy`, `pickle`, `dict()`)
is a plain, writable dict or list.
"""

from __future__ import annotations


def _refuse(self, *args, **kwargs):
    raise TypeError(f"a closed window's summary is read-only here ({type(self).__name__})")


class ReadOnlyDict(dict):
    __slots__ = ()
    __setitem__ = __delitem__ = __ior__ = _refuse
    clear = pop = popitem = setdefault = update = _refuse

    def __reduce__(self):
        return dict, (dict(self),)


class ReadOnlyList(list):
    __slots__ = ()
    __setitem__ = __delitem__ = __iadd__ = __imul__ = _refuse
    append = extend = insert = pop = remove = clear = sort = reverse = _refuse

    def __reduce__(self):
        return list, (list(self),)


LEAVES = {str, int, float, bool, type(None)}  # kept as they are, without a call


def freeze(value):
    """`value` with each dict and list in it (at any depth) a read-only copy; the rest (numbers,
    strings, None; a tuple holds its items' copies) as it is."""
    if isinstance(value, dict):
        return ReadOnlyDict({k: v if type(v) in LEAVES else freeze(v) for k, v in value.items()})
    if isinstance(value, list):
        return ReadOnlyList([v if type(v) in LEAVES else freeze(v) for v in value])
    if isinstance(value, tuple):
        return tuple(freeze(v) for v in value)
    return value
