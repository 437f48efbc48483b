class ReplicaGroup:
    def __init__(self, groups):
        self.groups = [tuple(g) for g in groups]
