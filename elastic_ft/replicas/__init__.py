"""Replica groups as the unit of failure: TorchFT's per-step quorum, kept in etcd instead of at a Lighthouse.

``quorum`` (the rule, pure), ``membership`` (a rank's records and the quorums it follows, through a watch),
``sentinel`` (the child process that holds a rank's lease and revokes it when the rank dies),
``process_group`` (the cross-replica group, rebuilt per quorum), ``manager`` (TorchFT's ``Manager``: the step
protocol). ``elastic_ft.torchft`` gives these TorchFT's names.
"""
