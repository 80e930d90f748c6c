"""Parameter-server side of shadowgba: the transport (typed messages over one gloo group per
trainer-server session, met through the job's store), the servers' checkpoints and the services it
hosts besides GBA's dense shards (`shadowgba.gba.server`): the S-EASGD centre and PS-hosted
embedding tables. Who is in the job and who failed is the job's own package (`shadowgba.job`),
which this package imports and never the other way round; nothing here imports the runtimes
(`shadowgba.shadow`, `shadowgba.gba`) or the factory."""
