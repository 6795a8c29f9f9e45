"""High availability: the I/O of a replicated primary/backup pair fenced by
ZooKeeper (docs/ha.md).  The decisions are in core/ha.py; nothing here is
imported unless the configuration has an `[ha]` section."""
