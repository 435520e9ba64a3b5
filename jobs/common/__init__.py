"""What every job uses: the Ray session, the report page writer and the progress lines' clock."""
