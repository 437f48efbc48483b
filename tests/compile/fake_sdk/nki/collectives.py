"""``nki.collectives.ReplicaGroup`` as NKI documents it: "Defines a group of ranks that participate in
a collective operation. Sub-groups represented by lists of ranks should not have any overlap."
(awsdocs-neuron.readthedocs-hosted.com/en/latest/nki/api/generated/nki.collectives.ReplicaGroup.html).
Nothing else is documented, so this one is opaque: no attribute, no length, no indexing. A kernel
that reads a mesh's size has to be given the mesh, not a ReplicaGroup."""


class ReplicaGroup:
    __slots__ = ("_ReplicaGroup__groups",)

    def __init__(self, replica_groups):
        groups = tuple(tuple(int(r) for r in g) for g in replica_groups)
        seen = [r for g in groups for r in g]
        if len(seen) != len(set(seen)):
            raise ValueError("ReplicaGroup: sub-groups must not overlap")
        object.__setattr__(self, "_ReplicaGroup__groups", groups)

    def __setattr__(self, name, value):
        raise AttributeError("ReplicaGroup is immutable")

    def __repr__(self):
        return "ReplicaGroup(...)"
