"""The training jobs (Ray Train): the shared trial and loop, and one subpackage per job."""
