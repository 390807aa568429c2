#!/bin/bash
# f4.sh ID KIND [command-template with RUN]
ID=$1; KIND=$2; CMD=${3:-"python -m emapg train --resume RUN steps=6"}
cd /tmp/reprobe/w; R=runs/D_$ID; rm -rf $R; cp -a runs/A $R; rm -f $R/.emapg.lock
/work/main/.venv/bin/python /tmp/reprobe/scripts/damage.py $R $KIND >/dev/null
( cd $R && find . -type f | sort | xargs sha256sum ) > /tmp/reprobe/out/$ID.before
TAILN=${TAILN:-4} /tmp/reprobe/p.sh $ID "${CMD//RUN/$R}"
( cd $R && find . -type f | sort | xargs sha256sum ) > /tmp/reprobe/out/$ID.after
echo "-- changed/removed files:"; diff /tmp/reprobe/out/$ID.before /tmp/reprobe/out/$ID.after | grep '^<' | awk '{print $3}' | head -12 | tr '\n' ' '; echo
grep -c Traceback /tmp/reprobe/out/$ID.txt | sed 's/^/tracebacks: /'
