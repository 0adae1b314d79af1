"""Cluster plumbing: TF_CONFIG, LocalCluster, TF's quiet start-up, task servers, ports,
network namespaces, connecting with a bound, and lost tasks."""
