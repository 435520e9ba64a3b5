"""What the extraction and training jobs both use: the Ray session and the report page writer."""
