"""Process groups (CPTopology) and the executor that runs plans on torch.distributed."""
