"""The job's own package: who is in the job, who failed, and what the job decided about it.

Every job has a membership, with or without parameter servers, so it lives here and not in the
transport (`shadowgba.ps`). One module per concept:

- `roles.py`: `Roles`, this rank's place among trainers and servers, and how failures name a rank;
- `rendezvous.py`: where the ranks of a job with servers meet (one torchrun job, or the elastic
  layout), and which torchrun attempt this is;
- `notices.py`: `NoticeBoard`, the job's notices (who left and why), heartbeats read, decisions;
- `heartbeat.py`: `Heartbeat`, a rank's beat on the board (a killed or stuck rank goes silent);
- `store.py`: the job's own store, started beside rank 0 where the store the ranks met at goes with
  one process, so that the board and the survivors' groups outlive any rank's exit;
- `blame.py`: `Blame`, which rank's failure ended the job, and `gone_peers`, the one rule for
  finding lost peers on the board;
- `survivors.py`: `SurvivingGroups`, which replica groups of a 2D job are in it (losses, rejoins);
- `roster.py`: `Roster`, a server's record of the trainers (members, departures, the failure);
- `config.py`: `PSConfig`, the `sync.ps` section every job reads (0 servers included).

Rules (checked by grep): no module here imports `shadowgba.ps`, nor a module of the runtimes,
the factory or the config that import this package; the transport and the runtimes import it.
This file imports nothing: import the modules themselves (`from shadowgba.job.roles import Roles`).
"""
