# Sourced first by every script in scripts/: `-h` or `--help` as the first argument prints the script's header
# comment (its usage: the comment lines after the shebang) and exits 0 before the script does anything else.
case "${1:-}" in
  -h|--help) echo "usage: bash scripts/$(basename "$0") [ARGS]  (scripts/$(basename "$0"))"
             sed -n '2,/^[^#]/{/^#SBATCH/d;/^#!/d;/^#/s/^# \{0,1\}//p}' "$0"; exit 0 ;;
esac
