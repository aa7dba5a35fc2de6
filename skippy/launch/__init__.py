"""Planning and starting: split the layers, launch local stage processes, wire stage 0 and
the API together for `skippy serve` and `skippy generate`."""
