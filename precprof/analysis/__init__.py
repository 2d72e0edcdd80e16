"""Host-side analysis of recorded tables: pure functions of tables and summaries, no capture, no IO."""
