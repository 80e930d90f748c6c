"""GBA and its synchronous twin on a trainer (`runtime.GBASync`) and its `sync.gba` config."""
