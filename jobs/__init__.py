"""Job entrypoints: parse config, plan shards, dispatch to Ray actors, reduce."""
