#!/bin/bash
# plugin-marker probe: pm.sh ID cmd ; prints IMPORTED/NOT
rm -f /tmp/reprobe/markers/hit
/tmp/reprobe/p.sh "$@"
if [ -f /tmp/reprobe/markers/hit ]; then echo "MARKER: IMPORTED ($(wc -l < /tmp/reprobe/markers/hit) times)"; echo "MARKER: IMPORTED" >> /tmp/reprobe/out/$1.txt; else echo "MARKER: not imported"; echo "MARKER: not imported" >> /tmp/reprobe/out/$1.txt; fi
