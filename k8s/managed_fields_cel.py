"""The CEL of hub_config/admission-policy.yaml's `tfdist-user-managed-fields` (run: prints it).

A client may send `metadata.managedFields` with its write, and the API server stores the entries it sends
(an Update or Apply entry under any manager name, with field paths the object does not have) as long as
they decode: up to etcd's ~1.5 MiB per object, past every size bound the other policies put on the
object's own fields. CEL cannot measure an object's bytes, and `fieldsV1` is an untyped tree of maps
(`{"f:spec": {"f:template": {...}}}`, every leaf `{}`), which CEL cannot walk to any depth. So the policy
walks it to a fixed depth, nested `map(...).sum()` calls that add up the keys' lengths, and counts a key
at that depth that still has children as a megabyte: a tree deeper than DEPTH is refused whatever its
size. The deepest path %%tfdist's own objects have is 10 keys (a container's environment variable from a
field reference: spec, template, spec, containers, k:{name}, env, k:{name}, valueFrom, fieldRef,
fieldPath).
"""

from __future__ import annotations

DEPTH = 12
TOO_DEEP = 1048576  # what a key at DEPTH with keys below it counts for: over any bound


def _path(keys: list[str], n: int, root: str) -> str:
    return root + "".join(f"[{k}]" for k in keys[:n])


def key_bytes(root: str = "e.fieldsV1", depth: int = DEPTH) -> str:
    """The length of every key of the tree `root` down to `depth`, added up; TOO_DEEP for each key at
    `depth` with keys of its own."""
    keys = [f"k{i}" for i in range(1, depth + 1)]
    last = keys[depth - 1]
    below = f"size({_path(keys, depth, root)}) * {TOO_DEEP}"
    expr = f"{_path(keys, depth - 1, root)}.map({last}, size({last}) + {below}).sum()"
    for i in range(depth - 1, 0, -1):
        expr = f"{_path(keys, i - 1, root)}.map({keys[i - 1]}, size({keys[i - 1]}) + {expr}).sum()"
    return expr


if __name__ == "__main__":
    print(key_bytes())
