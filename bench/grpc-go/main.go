// The baseline of the agent-memory benchmark (bench/README.md): the smallest server that
// accepts upstream's agents on a reference gRPC stack. It speaks the same service
// (cloud.bmaas.server.api.AgentCallback/Heartbeat) over mutual TLS, requiring a self-signed
// ed25519 client certificate as Shepherd does, with the same connection settings (at most 16
// streams per connection, keepalive pings every 60 s with a 20 s timeout, idle connections
// closed after 120 s). It stores nothing: a heartbeat is decoded (its fields kept as unknown
// fields) and answered with an empty HeartbeatResponse, which is what Shepherd answers when
// no installation is pending. Built with Debian's Go and grpc-go (scripts/grpc-go-baseline.sh).
package main

import (
	"context"
	"crypto/ed25519"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"flag"
	"fmt"
	"log"
	"net"
	"os"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/keepalive"
	"github.com/golang/protobuf/ptypes/empty"
)

// verifyAgent admits a client certificate only if it certifies an ed25519 key and is signed
// by that key.
func verifyAgent(rawCerts [][]byte, _ [][]*x509.Certificate) error {
	if len(rawCerts) == 0 {
		return errors.New("no client certificate")
	}
	cert, err := x509.ParseCertificate(rawCerts[0])
	if err != nil {
		return err
	}
	if _, ok := cert.PublicKey.(ed25519.PublicKey); !ok {
		return errors.New("client certificate must certify an ed25519 key")
	}
	return cert.CheckSignature(cert.SignatureAlgorithm, cert.RawTBSCertificate, cert.Signature)
}

func heartbeat(_ interface{}, ctx context.Context, dec func(interface{}) error, _ grpc.UnaryServerInterceptor) (interface{}, error) {
	request := new(empty.Empty)
	if err := dec(request); err != nil {
		return nil, err
	}
	return new(empty.Empty), nil
}

var agentCallback = grpc.ServiceDesc{
	ServiceName: "cloud.bmaas.server.api.AgentCallback",
	HandlerType: (*interface{})(nil),
	Methods:     []grpc.MethodDesc{{MethodName: "Heartbeat", Handler: heartbeat}},
	Metadata:    "cloud/bmaas/server/api/agentcallback.proto",
}

func main() {
	listen := flag.String("listen", "127.0.0.1:0", "address to listen on")
	certFile := flag.String("cert", "", "server certificate chain (PEM)")
	keyFile := flag.String("key", "", "server private key (PEM)")
	flag.Parse()
	cert, err := tls.LoadX509KeyPair(*certFile, *keyFile)
	if err != nil {
		log.Fatalf("loading the server certificate: %v", err)
	}
	config := &tls.Config{
		Certificates:          []tls.Certificate{cert},
		ClientAuth:            tls.RequireAnyClientCert,
		VerifyPeerCertificate: verifyAgent,
		MinVersion:            tls.VersionTLS13,
	}
	server := grpc.NewServer(
		grpc.Creds(credentials.NewTLS(config)),
		grpc.MaxConcurrentStreams(16),
		grpc.KeepaliveParams(keepalive.ServerParameters{
			MaxConnectionIdle: 120 * time.Second,
			Time:              60 * time.Second,
			Timeout:           20 * time.Second,
		}),
	)
	server.RegisterService(&agentCallback, nil)
	listener, err := net.Listen("tcp", *listen)
	if err != nil {
		log.Fatalf("listen %s: %v", *listen, err)
	}
	fmt.Printf("grpc-go baseline: listening on %s\n", listener.Addr())
	os.Stdout.Sync()
	if err := server.Serve(listener); err != nil {
		log.Fatal(err)
	}
}
