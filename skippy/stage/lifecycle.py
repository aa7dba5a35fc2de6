"""What a `skippy stage` process tells whoever started it (a launcher waits on these)."""

READY_PREFIX = "skippy: stage ready:"   # the line on stdout once the stage serves
EXIT_ADDRESS_IN_USE = 98                 # exit status when the bind address is taken
