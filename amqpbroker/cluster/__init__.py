"""A cluster of broker nodes serving as one broker (docs/cluster.md).

Loaded only by `serve --workers N` (N > 1) or a `[cluster]` section: a broker alone
imports nothing from here."""
