# One rank of the launcher's tests: sh rank.sh DIR ACTION WHO
# Records its environment and "pid child-pid" in DIR, then ACTION: on rank WHO, once every rank
# has recorded itself, "exit3" exits 3 and "sigkill" kills itself; "env" ends every rank at once;
# otherwise the rank waits for its child (a minute).
d=$1
action=$2
who=$3
sleep 60 &
child=$!
env > "$d/rank$RANK.env"
echo "$$ $child" > "$d/rank$RANK.tmp" && mv "$d/rank$RANK.tmp" "$d/rank$RANK.pid"
if [ "$action" = env ]; then
    kill "$child"
    exit 0
fi
if [ "$RANK" = "$who" ]; then
    while [ "$(ls "$d" | grep -c '\.pid$')" -lt "$WORLD_SIZE" ]; do sleep 0.05; done
    case $action in
        exit3) exit 3 ;;
        sigkill) kill -9 $$ ;;
    esac
fi
wait
