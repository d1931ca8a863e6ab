# Prints, for each failed test in a `ctest --output-on-failure` log, its
# status line and the last 30 lines of its output, prefixed "test.sh: ".
# tools/test.sh prints this last, since CI keeps only the end of a run.
#
#   awk -f tools/failed_test_output.awk build/ctest.log
function flush(   i, first) {
  if (!open) return
  print "test.sh: " header
  first = n > 30 ? n - 30 : 0
  for (i = first; i < n; i++) print "test.sh: | " buf[i % 30]
  open = 0
}
/^ *[0-9]+\/[0-9]+ Test +#/ {
  flush()
  # Failed, timed out, crashed, or could not run; not passed or skipped.
  if ($0 ~ /\*\*\*(Failed|Timeout|Exception)/ ||
      ($0 ~ /Not Run/ && $0 !~ /Disabled/)) {
    open = 1; n = 0; header = $0
  }
  next
}
/^ +Start +[0-9]+: / || /^[0-9]+% tests passed/ { flush(); next }
open { buf[n % 30] = $0; n++ }
END { flush() }
