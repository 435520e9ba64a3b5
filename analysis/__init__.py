"""Every table of an extraction job: the producers (analyses and shard tables) behind one protocol
(:mod:`~actlake.analysis.protocol`), the engine they read from (:mod:`~actlake.analysis.engine`) and the
registry of the built-in ones (:mod:`~actlake.analysis.registry`)."""
