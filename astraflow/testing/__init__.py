"""Support for testing AstraFlow runs, and a user's own plug-ins, against a real broker and bucket
(in the spirit of ``numpy.testing``): nothing here is a fake of Kafka or S3.

* :mod:`astraflow.testing.runs`: start a private embedded stack, run a recipe through the real
  launcher, read back what the run left on the log (batches, trajectories, weight announcements,
  metrics records);
* :mod:`astraflow.testing.bad_records`: inject malformed records of every kind into the topics a run
  reads and account for each one in the run's dead letters.

Used by tests/ and benchmarks/ alike, so that neither imports the other.
"""
