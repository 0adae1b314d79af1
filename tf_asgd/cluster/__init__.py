"""Cluster plumbing: TF_CONFIG, LocalCluster, task servers, network namespaces,
connecting with a bound, and lost tasks."""
