#!/bin/sh
# Touches "$1/$RANK", saying so on stdout.
FILE="$1/$RANK"
echo "creating $FILE"
touch "$FILE"
