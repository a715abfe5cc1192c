"""What the test suite and the soak benchmark share: the real services as subprocesses, a load
client that checks every answer, and the one polling helper. Needs the [dev] extra (psutil)."""
