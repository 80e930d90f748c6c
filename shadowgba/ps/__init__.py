"""Parameter-server side of shadowgba: the transport (typed messages over one gloo group per
trainer-server session, met through the job's store), membership, the servers' checkpoints and the
services it hosts besides GBA's dense shards (`shadowgba.gba.server`): the S-EASGD centre and
PS-hosted embedding tables."""
