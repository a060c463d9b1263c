#!/usr/bin/env bash
# Make sure the loopback services that tests and benchmarks talk to are up.
# Starts any that is down with Debian's commands; fails loudly if one cannot be started.
set -uo pipefail
wanted="${*:-redis mariadb postgresql}"

up() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

start() {
  case "$1" in
    redis) redis-server --daemonize yes --bind 127.0.0.1 -::1 --port 6379 --save "" \
             --appendonly no --dir /var/lib/redis --logfile /var/log/redis/ci.log ;;
    mariadb) start-stop-daemon --start --oknodo --background --exec /usr/sbin/mariadbd ;;
    postgresql) pg_ctlcluster --skip-systemctl-redirect "$(ls /etc/postgresql | head -1)" main start ;;
    nats) start-stop-daemon --start --oknodo --background --exec /usr/sbin/nats-server -- \
            -a 127.0.0.1 -p 4222 -js -sd /var/lib/nats-server -l /var/log/nats-server.log ;;
    rabbitmq) rabbitmq-server -detached ;;
    etcd) bash "$(dirname "$0")/etcd.sh" >&2 &&
          mkdir -p /var/lib/onceq-etcd &&
          start-stop-daemon --start --oknodo --background --make-pidfile \
            --pidfile /run/onceq-etcd.pid --exec "$(command -v etcd)" -- \
            --name onceq --data-dir /var/lib/onceq-etcd \
            --listen-client-urls http://127.0.0.1:2379 --advertise-client-urls http://127.0.0.1:2379 \
            --listen-peer-urls http://127.0.0.1:2380 --initial-advertise-peer-urls http://127.0.0.1:2380 \
            --initial-cluster onceq=http://127.0.0.1:2380 ;;
  esac
}

port_of() {
  case "$1" in
    redis) echo 6379 ;; mariadb) echo 3306 ;; postgresql) echo 5432 ;;
    nats) echo 4222 ;; rabbitmq) echo 5672 ;; etcd) echo 2379 ;;
    *) echo "unknown service $1" >&2; exit 2 ;;
  esac
}

failed=0
for svc in $wanted; do
  port=$(port_of "$svc")
  if up "$port"; then continue; fi
  echo "services: $svc is down on 127.0.0.1:$port, starting it" >&2
  start "$svc" >/dev/null 2>&1 || true
  for _ in $(seq 1 60); do up "$port" && break; sleep 0.5; done
  if ! up "$port"; then
    echo "services: FAILED to start $svc on 127.0.0.1:$port" >&2
    failed=1
  fi
done
exit $failed
