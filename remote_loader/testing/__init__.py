"""Apart from the library proper: an embedded S3 server and generated images, for the
demo, the examples, the benchmarks and the tests."""
