"""Which layers the contributions charts draw."""


def test_the_contribution_charts_pick_layers_the_table_has():
    """A hybrid's contributions table has its attention layers only (every 4th block of Qwen3-Next): the charts'
    second, middle and last layer are picked among those, not among block numbers."""
    import duckdb

    from actlake.analysis.contributions import contribution_layers

    con = duckdb.connect()
    con.execute("CREATE TABLE contributions AS SELECT * FROM (VALUES (3), (7), (11), (15), (19)) t(layer)")
    assert contribution_layers(con) == [7, 11, 19]
    con.execute("CREATE OR REPLACE TABLE contributions AS SELECT range AS layer FROM range(12)")
    assert contribution_layers(con) == [1, 6, 11]
