def pytest_collection_finish(session):
    """The session's final selection, for triton_interp.interpreted_together (one interpreter
    process per module runs that module's selected tests)."""
    import triton_interp
    triton_interp.collection_finished(session.items)
