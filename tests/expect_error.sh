# Sourced by the CLI tests: expect_error WHAT NEEDLE CMD... runs CMD, which must fail with a
# message containing NEEDLE.
expect_error() {
  what="$1"
  needle="$2"
  shift 2
  if out=$("$@" 2>&1); then
    echo "$what succeeded: $out"
    exit 1
  fi
  case "$out" in
    *"$needle"*) echo "ok ($what): $out" ;;
    *) echo "unexpected message ($what): $out"; exit 1 ;;
  esac
}
