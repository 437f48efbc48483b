"""The build: stages, their cache, shard emission, the manifest."""
